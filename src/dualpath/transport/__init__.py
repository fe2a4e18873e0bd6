"""The data plane both real worlds (the runtime and the vLLM integration) stand on, written once.

- `transfer_error.py`  TransferError (a transfer failed, timed out or addressed unregistered
               bytes), BufferFullError (a slot pool refused an allocation).
- `nixl.py`    one NIXL agent (UCX): memory registered as DRAM or VRAM, peers, READ/WRITE
               batches posted now and waited for with a timeout and backoff; its progress
               thread sleeps in poll() instead of spinning; an agent may carry a traffic class.
- `traffic_class.py`  the KV traffic's InfiniBand service level and RoCE traffic class, set on
               one agent's UCX backend only (NIXL's `engine_config`), never the environment.
- `fabric_qos.py`  the switch and NIC side of the two classes, as text (OpenSM, mlnx_qos).
- `link_classes.py`  the two classes on an emulated host's Linux link (tc HTB, KV low).
- `pacing.py`  one token-bucket pacer: an emulated NIC direction's FIFO clock, booked before
               the real I/O so the two overlap.
- `slots.py`   one pool of fixed-size slots (Full Blocks) in a shared-memory segment: held
               until freed, blocking or refusing when full, sized in bytes or slots.

Below `runtime` and `integrations`, above `sched` and `core`; it imports neither world
(import-linter keeps both rules).
"""
