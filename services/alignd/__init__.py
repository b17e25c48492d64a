"""libalign's services: the ``alignd`` command line today; converter, learner, sampler and
API daemons build on :mod:`libalign` here."""
