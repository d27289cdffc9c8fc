"""stream/join: the joiner, impressions + delayed clicks -> labelled events, exactly once.

policy.py   the join's rules: JoinRules and its policies, the pure transitions, the Cursor
inputs.py   impression and click records -> the join's records
outputs.py  what the join emitted -> records for the events topic
state.py    the state on disk: one RocksDB per input partition
partitions.py  each input partition in memory; the two inputs read in step (Inputs)
transactions.py  a chunk's outputs and offsets in one Kafka transaction
reroute.py  records on another partition than their id's, carried to theirs
joiner.py   the shell: a chunk of records -> the Cursor -> one RocksDB write -> one Kafka transaction
group.py    joiners on several machines: Kafka's group assigns the partitions, a changelog carries the state
"""
