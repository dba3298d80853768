"""Disaggregated RL: an actor pool and a critic pool exchanging batches through Redis
(docs/pools.md).  ``wire`` (message format), ``store`` (Redis streams), ``actor``, ``critic``,
``run`` (the ``--role`` entry point), ``plan`` (sizing each pool)."""
