"""The recipe: the YAML a run is launched from, read into typed sections (``sections``), checked as a whole
against the model and the world size (``config``), and its hardware fields checked against this machine
(``device_fields``)."""
