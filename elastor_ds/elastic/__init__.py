"""The elastic controller: ``elastor run`` keeps a training job alive through process and device
losses, scales it back up when devices return, and stops it cleanly on preemption.

Pure decision logic (no torch): :mod:`protocol` (the controller <-> worker contract: environment
variables, exit codes, heartbeat files), :mod:`policy` (which devices are usable, shrink / restart /
probe, restart budget), :mod:`events` (event records and the recovery breakdown).
Effects: :mod:`agent` (torch.distributed.elastic's ``LocalElasticAgent`` with elastor's run loop),
:mod:`probe` (GPU health probes in subprocesses), :mod:`report` (summary table, timeline PNG),
:mod:`worker` and :mod:`worker_main` (the trainer side: heartbeat, graceful stop, parent-death
signal), :mod:`cli` (``elastor run``).
"""
