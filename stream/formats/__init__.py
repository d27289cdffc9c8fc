"""stream/formats: the record formats below the producers, the joiner and the featurizer."""
