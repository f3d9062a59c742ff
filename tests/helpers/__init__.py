"""Code the tests share, kept out of the package: ``from helpers.oom import OOMInjector``.

* :mod:`.oom` -- OOM injection: :class:`~helpers.oom.OOMInjector`, :class:`~helpers.oom.InjectingGuard`.
* :mod:`.lm` -- a small GPT-shaped language model as a model file's source (``LM_SOURCE``).

Importable as ``helpers`` because pytest puts ``tests/`` (the folder of the root conftest.py,
which has no ``__init__.py``) first on ``sys.path``; benchmarks that reuse these insert
``tests/`` themselves.
"""
