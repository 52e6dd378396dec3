"""The bookkeeping of dlm's pre-registered studies (issue 17): plans, locked tables, seed statistics, kept starts,
claims, the run queue and the writers of the results docs. benchmarks/ uses it; the library (`dlm`) never imports it."""
