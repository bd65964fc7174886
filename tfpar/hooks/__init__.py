"""tfpar.hooks."""
