"""The contracts every process of the server shares: the messages that cross a process
boundary and the model specs they carry (`protocol`), the channel that carries them
between the front end and each child (`channel`: ZeroMQ over ipc), result arenas in shared
memory (`shm`), device names (`devices`), and what the front end and the workers both
read of a model folder (`folders`).

The rule the tree keeps: this package imports nothing else of ours; `workers` imports
only this package (and its own modules); the front end starts a worker by its entry
point (`"workers.inference.worker:main"`) and runs worker code in its own process only
through one named path, the inline tokenizer for small requests (`infinity.client.engine_client`).
"""
