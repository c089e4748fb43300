"""Model clients: the ModelClient Protocol and its clients, tokens, capabilities, deadlines, the embedded model."""
