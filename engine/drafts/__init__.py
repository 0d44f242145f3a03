"""The draft models: the shipped ones, trained draft folders, feature drafts and the drafter that runs them."""
