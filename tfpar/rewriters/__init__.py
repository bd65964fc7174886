"""tfpar.rewriters."""
