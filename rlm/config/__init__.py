"""The option registry and what is built from it: run configuration, journal records, argument types."""
