"""The task: what memplan is told about a model -- the model-file contract (``Task``, ``load_task``),
its data and the shapes of its items, and the model file's ``settings``."""
