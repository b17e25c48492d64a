"""libalign: the numerical core of the learner-sampler alignment daemon.

Pure functions on tensors, no I/O: the executable NVFP4 spec (:mod:`libalign.spec`), its
rounding and layouts, checkpoint conversion and the context-independence test.
"""

__version__ = "0.1.0"
