"""The decode instance's half of the DE read path: a staging buffer of Full Block slots, and
the side channel (TCP) through which prefill workers use it.

Per transfer (`xfer`, the router's id for a request), the staging buffer holds the blocks the
decode instance loads into its paged KV when the request arrives for decoding:

- `Stage`: the staging service reads the request's DE-side hit blocks from storage into free
  slots (storage -> decode DRAM); the prefill worker then pulls them over NIXL, layer by layer.
- `Alloc` + `Commit`: the prefill worker writes the blocks the decode instance lacks (those it
  read itself and those it computed, the partial tail included) into slots over NIXL and
  commits them; only committed or staged slots are ever loaded.
- `Lookup` + `Release`: the decode worker finds the slots of a request's blocks, copies them
  into its paged KV, and gives them back.

Files, one concept each:

- `wire.py`      the typed requests and replies and their wire format (one JSON object per
                 line, tagged with the message type and the protocol version).
- `staging.py`   `StagingPool`: the transport's slot pool, held per transfer.
- `tcp_server.py` `DecodeSideChannel`: the staging service's TCP server.
- `client.py`    `SideChannelClient` (a prefill or decode worker's connection) and
                 `RemotePool` (the decode worker's view of the service's buffer).
- `cpus.py`      which cores the staging service runs on.
- `service.py`   the staging service as its own process: `spawn_side_channel` and its main.
"""
