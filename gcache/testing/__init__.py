"""Fixtures the tests and benches share (tiny models written offline, engine runs, SGLang's
storage modules without its server). Never imported by the product: a layer above the adapters."""
