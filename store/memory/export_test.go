package memory

// RecordCost is what a record counts against WithMaxBytes before its outcome.
const RecordCost = recordCost
