"""KV transfer between a prefill and a decode worker (seed Sections 3.2 and 3.3): the frame wire
format (wire.py), the sender and its retries (transfer.py), the persistent lane per decode
endpoint (lane.py), the receiver (receiver.py), landing frames straight in the KV blocks
(landing.py) and the transfer settings (config.py). docs/pd.md describes the protocol."""
