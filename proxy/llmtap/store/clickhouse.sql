-- llmtap request records in ClickHouse: one row per finished request, every request (unsampled).
-- The record's fields are columns (nested ones flattened with a prefix: objective_*, slots_*, gaps_*,
-- tokens_*, cache_*, cost_*); the prompt's regions and the attribution stay JSON strings (prompt_json,
-- attribution_json). Runs on ClickHouse 18.16
-- (Debian's package) and later: no DateTime64 (time_s keeps the milliseconds), no Nullable key columns.
-- Partitioned by day; ordered for the questions asked: a route, a prompt version, a time range.
-- {table} is the table's name; llmtap runs this statement when it starts (CREATE ... IF NOT EXISTS),
-- then applies the TTL (--record-clickhouse-ttl-days) with ALTER TABLE ... MODIFY TTL on ClickHouse 19.6
-- and later, and says in its log that it cannot on an older server. A table made by an earlier version gets
-- the columns added since (ALTER TABLE ... ADD COLUMN), so its older rows read null there.
-- One row per record: a journal replays records at least once, so the same record can be inserted
-- twice. The table replaces rows of one sorting key, which ends with record_id (the record's own id, made with the
-- request whether or not it is traced; for a record of an older version its trace and span ids; a record with
-- neither has a random one, starting with '-'): copies merge into one row in the background. Until they have, and
-- in a table of an earlier version (a MergeTree, which keeps every row: an engine cannot be changed in place), the
-- readers count each record once (llmtap.store.clickhouse_read: LIMIT 1 BY the record's identity).
CREATE TABLE IF NOT EXISTS {table}
(
    schema UInt8,
    time DateTime('UTC'),
    time_s Float64,
    trace_id String,
    span_id Nullable(String),
    instance_id Nullable(String),
    host Nullable(String),
    pid Nullable(UInt32),
    llmtap_version Nullable(String),
    response_id Nullable(String),
    route LowCardinality(String),
    upstream Nullable(String),
    protocol Nullable(String),
    operation Nullable(String),
    model Nullable(String),
    response_model Nullable(String),
    stream UInt8,
    status Nullable(UInt16),
    outcome Nullable(String),
    error_type Nullable(String),
    slo Nullable(String),
    shape Nullable(String),
    objective_shape Nullable(String),
    objective_percentile Nullable(Float64),
    objective_ttft Nullable(Float64),
    objective_tpot Nullable(Float64),
    objective_e2e Nullable(Float64),
    prompt_version String,
    ttft Nullable(Float64),
    ttfb Nullable(Float64),
    upstream_ttft Nullable(Float64),
    tpot Nullable(Float64),
    e2e Nullable(Float64),
    queue Nullable(Float64),
    queue_source Nullable(String),
    prefill Nullable(Float64),
    prefill_source Nullable(String),
    decode Nullable(Float64),
    server_decode Nullable(Float64),
    slots_value Nullable(Int64),
    slots_source Nullable(String),
    slots_confidence Nullable(Float64),
    gaps_n UInt32,
    gaps_p50 Nullable(Float64),
    gaps_p95 Nullable(Float64),
    gaps_max Nullable(Float64),
    tokens_input Nullable(Int64),
    tokens_input_source Nullable(String),
    tokens_output Nullable(Int64),
    tokens_output_source Nullable(String),
    tokens_cache_read Nullable(Int64),
    tokens_cache_write Nullable(Int64),
    tokens_reasoning Nullable(Int64),
    prompt_json Nullable(String),
    cache_class Nullable(String),
    cache_changed_region Nullable(String),
    cache_expected_prefix_tokens Nullable(Int64),
    cache_cached_tokens Nullable(Int64),
    cache_min_tokens Nullable(Int64),
    cost_amount Nullable(Float64),
    cost_status Nullable(String),
    request_ttft Nullable(Float64),
    request_tpot Nullable(Float64),
    request_ttft_outcome Nullable(String),
    request_tpot_outcome Nullable(String),
    record_id String,
    ttfot Nullable(Float64),
    ttst Nullable(Float64),
    objective_ttfot Nullable(Float64),
    objective_ttst Nullable(Float64),
    upstream_unattributed Nullable(Float64),
    tokens_cache_write_1h Nullable(Int64),
    cost_currency Nullable(String),
    cost_source Nullable(String),
    cost_prices Nullable(String),
    attribution_json Nullable(String)
)
ENGINE = ReplacingMergeTree
PARTITION BY toDate(time)
ORDER BY (route, prompt_version, time, record_id)
