"""Loading contexts: files, directories, formats, listings."""
