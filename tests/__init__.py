"""The test suite is a package, as each of its folders: a test module is imported by its dotted path
(``tests.memory.test_oom``), so that two folders may hold files of the same name, and a test imports the shared
helpers as ``from tests.launching import ...`` whether pytest runs the whole suite or one file (docs/testing.md)."""
