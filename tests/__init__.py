"""The package's own tests, laid out as the package is (docs/ say which file covers what)."""
