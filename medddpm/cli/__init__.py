"""`python -m medddpm`: the subcommands (`main`) and the arguments they share (`args`)."""
