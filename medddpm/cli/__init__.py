"""`python -m medddpm`: the subcommands (`main`, `parser`, `commands`), the arguments they share (`args`), and
torchrun's entry point for data-parallel training (`distributed`)."""
