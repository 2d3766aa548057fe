"""Several gateway processes over one worker pool (``[server] processes``): the supervisor that binds
the listeners once and starts the processes (:mod:`.supervisor`), what a gateway process learns from
it (:mod:`.process`), the sockets it inherits (:mod:`.inherited`), QUIC steering by connection ID
(:mod:`.steering`), and the state the processes share on one host (:mod:`.metrics_merge`, tickets in
:mod:`gateway.http.ticket_dir`)."""
