"""Stages: the tree behind one lock, the status model, the ``with`` block, the text rendering."""
