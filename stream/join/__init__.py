"""stream/join: the joiner, impressions + delayed clicks -> labelled events, exactly once.

policy.py   the join's rules: JoinRules and its policies, the pure transitions, the Cursor
inputs.py   impression and click records -> the join's records
outputs.py  what the join emitted -> records for the events topic
state.py    the state on disk: one RocksDB per input partition
joiner.py   the shell: a chunk of records -> the Cursor -> one RocksDB write -> one Kafka transaction
"""
