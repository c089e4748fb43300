"""One run: drive, the run tree, the turn loop, sub-calls, checked answers."""
