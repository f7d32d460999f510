"""The package version, in a module of its own so that code inside the package (the job fingerprint) reads
it without importing the package root, whose lazy Python API would close an import cycle."""
__version__ = "0.1.0"
