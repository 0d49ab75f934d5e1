"""Measurement, split by what it measures: `timing` (how long a step takes), `profile` (where its time goes on the
hardware), `memory` (what it holds), `study` (whether a configuration trains as well) and `scaling` (how it spreads
over ranks). Above them, one measured run of the producer notebook (`run`: its phases call the others), the sweep
that runs it per configuration (`sweep`) and its back-ends (`cluster`); beneath them, the machine (`env`) and the
checks of a user's labels and texts (`validate`). Nothing here reads the book's side (`medddpm.report`) or the
command line (`medddpm.cli`)."""
