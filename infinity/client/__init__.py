"""The engine client: the front end's side of the child processes. Admission and the
ledger of requests in flight (`engine_client`), where the children and each model's
replicas run (`topology`), and how the children are started, watched and restarted
(`supervisor`). It knows no HTTP: what goes wrong is a `ServingError` of a kind."""
