"""Other engines running pivotspec's acceptance rules. Each integration imports its engine only inside itself."""
