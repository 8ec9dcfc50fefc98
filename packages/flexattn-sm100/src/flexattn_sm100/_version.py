__version__ = "0.1.0"  # keep equal to pyproject.toml [project].version (a test checks)
