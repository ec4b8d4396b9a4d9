"""The ``accelerate-memsafe`` command line. Nothing in the library imports this package."""
