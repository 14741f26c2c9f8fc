"""The slow tier: real servers started as subprocesses and real model folders (the
packaged default, tiny ones built at test time), checked against reference
implementations. One folder per model kind, `serving/` for what every kind shares (the
server's processes, limits, API and clients), `engines/` for the engines and model
folders run in the test's own process."""
