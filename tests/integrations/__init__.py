"""The SGLang integration group (see conftest.py); a package so its conftest does not
shadow tests/conftest.py as the module `conftest`."""
