"""What the model reads and writes: the prompts and the reply parser (a leaf)."""
