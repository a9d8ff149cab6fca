"""The package version, on the ground floor so the command line can print it without importing the library."""
__version__ = "0.1.0"
