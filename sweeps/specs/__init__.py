"""Ready-made sweep specs: ``tiny`` (tests, notebooks), ``showcase`` (``make run``)."""
