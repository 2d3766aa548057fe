"""What the gateway and the workers share that is not the transport itself: every worker option and
its one default (``worker_options``), the log formats both sides write (``logfmt``), the prefix
cache's block-hash chain that workers report and gateways compute (``prefix``), and the series of a
worker's ``Stats`` as metrics (``stats_series``). JAX-free, like the rest of transport/."""
