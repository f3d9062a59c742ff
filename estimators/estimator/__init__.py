"""The estimate: :class:`Estimator` puts tracing, the memory model and the time model together
for one task on one target -- the traces it makes (each once, on both cores), batch scaling
from a few anchor sizes, and the predicted timeline."""
