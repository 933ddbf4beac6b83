"""walbridge's top floor: what an operator runs.

The ``walbridge`` command (:mod:`walbridge.cli`) and the consumer's
``spark-submit`` entry (:mod:`walbridge.spark_submit`), runtime concerns
(:mod:`walbridge.runtime`), ``up``, ``status``, ``verify``, ``reconcile``, their
rendering (:mod:`walbridge.render`) and the embedded servers. It imports the
data paths (``producer``, ``spark_consumer``) and their shared ground
(``schemas``); nothing imports it.
"""
