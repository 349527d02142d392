"""The application layer: the command line, building and running a configured run, sweeps and tracking."""
