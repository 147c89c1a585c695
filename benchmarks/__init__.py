"""The studies: engine, kernels, decode, preemption, the fleet (``fleet/``: the simulator, the
policy study, the scheduler at fleet scale) and reliability (``reliability/``).

Installed as ``pagefleet.benchmarks`` (one import root); run as ``pagefleet bench <name>``
(``pagefleet.bench`` routes there). What users run against their own deployment
(``pagefleet bench serve``, and ``sim-fit`` for ``--engine sim``) stays in ``pagefleet.bench``.
Every study's JSON starts with the same header (``results.header``).
"""
