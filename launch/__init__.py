"""The command line and the set-up the README names."""
