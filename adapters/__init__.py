"""Framework adapters (DSPy, LangChain), shipped as `prefixrt.adapters` (docs/adapters.md)."""

if __name__ != "prefixrt.adapters":  # found as top-level `adapters` because the repo root is on sys.path
    from prefixrt.source_tree import import_installed

    import_installed(__name__, __file__)
