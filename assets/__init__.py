"""One module per stage of the loop; thin wrappers that call ops/ and record lineage."""
