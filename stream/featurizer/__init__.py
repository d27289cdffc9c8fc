"""stream/featurizer: labelled events -> feature batches, in the Faust worker (app.py).

decode.py and json_batch.py check JSON events, bundle.py Arrow bundles, featurize.py turns checked
columns into feature ids and floats (serving calls the same functions), ingest.py runs a take's
records through them, outputs.py plans what a take writes."""
