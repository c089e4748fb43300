"""Seeing a run: the live terminal view, the HTML view, OpenTelemetry spans."""
