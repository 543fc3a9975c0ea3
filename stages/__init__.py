"""Pipeline stages: one module per stage, each with a typed config class and `run(cfg, ctx)`.

Stages meet only through artifacts named in `pipeline.registry`; they never import each other.
Heavy packages are imported inside functions so `import stages` stays light.
"""
