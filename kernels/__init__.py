"""Triton kernels and their torch references, shipped as `prefixrt.kernels` (docs/kernels.md)."""

if __name__ != "prefixrt.kernels":  # found as top-level `kernels` because the repo root is on sys.path
    from prefixrt.source_tree import import_installed

    import_installed(__name__, __file__)
