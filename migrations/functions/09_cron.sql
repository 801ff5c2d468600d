-- migrations/functions/09_cron.sql: Cron: the expression parser, due slots, and the enqueue
-- of each slot once.
--
-- Defines:
--   internal_cron_field, internal_cron_parse, internal_cron_previous_local
--   internal_cron_slot_instant, internal_cron_latest_slot, internal_cron_due_slot
--   internal_enqueue_cron_slots, internal_cron_schedules_before_write
--   trigger cron_schedules_before_write

-- ---- Cron --------------------------------------------------------------------------------
--
-- Cron expressions are read and evaluated here, in one place, for every caller: the Rust
-- worker's scheduler and skiplock.maintain both enqueue due slots with
-- skiplock.internal_enqueue_cron_slots, and a schedule is checked as it is written
-- (skiplock.internal_cron_schedules_before_write), whoever writes it.
--
-- Syntax: 5 fields (minute hour day-of-month month day-of-week) or 6 with seconds first.
-- Each field is `*`, a value, a range `a-b`, a step `*/n`, `a-b/n` or `a/n` (from a to the
-- field's end), or a comma list of those. Months take JAN-DEC, weekdays SUN-SAT (0 and 7
-- are Sunday), any case. Day-of-month takes `L` (the month's last day); day-of-month and
-- day-of-week take `?` as `*`. When both day fields are restricted, a day matches either
-- (as in Vixie cron); when one is `*` or `?`, the other decides.

-- The values one field allows, in order; the day-of-month's `L` is 32. Raises
-- invalid_parameter_value naming the field, its text and its character positions.
CREATE OR REPLACE FUNCTION skiplock.internal_cron_field(expression text, field text,
                                                        field_name text, field_start int,
                                                        low int, high int,
                                                        names text[] DEFAULT NULL,
                                                        first_named int DEFAULT 0)
RETURNS int[]
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    item text;
    parts text[];
    ends text[];
    bounds int[];
    step int;
    a int;
    b int;
    last_day boolean;
    found int[] := '{}';
BEGIN
    FOREACH item IN ARRAY string_to_array(field, ',') LOOP
        parts := string_to_array(item, '/');
        a := NULL;
        b := NULL;
        step := 1;
        last_day := false;
        IF cardinality(parts) = 2 AND parts[2] ~ '^[0-9]{1,4}$' AND parts[2]::int > 0 THEN
            step := parts[2]::int;
        ELSIF cardinality(parts) <> 1 THEN
            parts := NULL;
        END IF;
        IF item = 'L' AND field_name = 'day-of-month' THEN
            a := 32;
            b := 32;
            last_day := true;
        ELSIF parts[1] = '*' OR (parts[1] = '?' AND field_name LIKE 'day-of-%') THEN
            a := low;
            b := high;
        ELSIF parts[1] IS NOT NULL THEN
            ends := string_to_array(parts[1], '-');
            IF cardinality(ends) IN (1, 2) THEN
                SELECT array_agg(CASE WHEN e ~ '^[0-9]{1,4}$' THEN e::int
                                      ELSE array_position(names, upper(e)) - 1 + first_named END
                                 ORDER BY n)
                INTO bounds FROM unnest(ends) WITH ORDINALITY AS t(e, n);
                a := bounds[1];
                b := CASE WHEN cardinality(bounds) = 2 THEN bounds[2]
                          WHEN cardinality(parts) = 2 THEN high
                          ELSE a END;
            END IF;
        END IF;
        IF a IS NULL OR b IS NULL OR (NOT last_day AND (a < low OR b > high OR a > b)) THEN
            RAISE EXCEPTION 'invalid cron expression `%`: % field `%` (characters %-%) is wrong: %',
                expression, field_name, field, field_start, field_start + length(field) - 1,
                CASE field_name
                    WHEN 'hour' THEN 'use 0-23, a list (9,17), a range (9-17), a step (*/2) or *'
                    WHEN 'day-of-month' THEN 'use 1-31, L, a list (1,15), a range (1-7), a step (*/2) or *'
                    WHEN 'month' THEN 'use 1-12 or JAN-DEC, a list, a range, a step or *'
                    WHEN 'day-of-week' THEN 'use 0-7 (0 and 7 are Sunday) or SUN-SAT, a list, a range, a step or *'
                    ELSE 'use 0-59, a list (0,30), a range (10-20), a step (*/15) or *' END
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        found := found || ARRAY(SELECT generate_series(a, b, step));
    END LOOP;
    RETURN ARRAY(SELECT DISTINCT v FROM unnest(found) v ORDER BY v);
END;
$$;

-- A cron expression read into the values each field allows (seconds {0} for 5 fields).
-- interval_job: the seconds (if given), minute or hour field starts with `*`, so the
-- schedule repeats within the hour or every few hours (how a repeated local hour is
-- handled depends on it, see skiplock.internal_cron_due_slot).
CREATE OR REPLACE FUNCTION skiplock.internal_cron_parse(expression text,
    OUT seconds int[], OUT minutes int[], OUT hours int[], OUT days int[], OUT months int[],
    OUT weekdays int[], OUT days_any boolean, OUT weekdays_any boolean,
    OUT interval_job boolean)
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    texts text[] := '{}';
    starts int[] := '{}';
    start int;
    o int;
BEGIN
    IF expression IS NULL OR length(expression) > 1000 THEN
        RAISE EXCEPTION 'invalid cron expression: %',
            CASE WHEN expression IS NULL THEN 'it is NULL' ELSE 'it is over 1000 characters' END
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR i IN 1 .. length(expression) + 1 LOOP
        IF i > length(expression) OR substr(expression, i, 1) ~ '\s' THEN
            IF start IS NOT NULL THEN
                texts := texts || substr(expression, start, i - start);
                starts := starts || start;
                start := NULL;
            END IF;
        ELSIF start IS NULL THEN
            start := i;
        END IF;
    END LOOP;
    IF cardinality(texts) NOT IN (5, 6) THEN
        RAISE EXCEPTION 'invalid cron expression `%`: expected 5 fields (minute hour day-of-month month day-of-week) or 6 (with seconds first), found %',
            expression, cardinality(texts)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    o := cardinality(texts) - 5;
    seconds := CASE WHEN o = 1
        THEN skiplock.internal_cron_field(expression, texts[1], 'second', starts[1], 0, 59)
        ELSE '{0}' END;
    minutes := skiplock.internal_cron_field(expression, texts[o + 1], 'minute', starts[o + 1], 0, 59);
    hours := skiplock.internal_cron_field(expression, texts[o + 2], 'hour', starts[o + 2], 0, 23);
    days := skiplock.internal_cron_field(expression, texts[o + 3], 'day-of-month', starts[o + 3], 1, 31);
    months := skiplock.internal_cron_field(expression, texts[o + 4], 'month', starts[o + 4], 1, 12,
        '{JAN,FEB,MAR,APR,MAY,JUN,JUL,AUG,SEP,OCT,NOV,DEC}', 1);
    weekdays := ARRAY(SELECT DISTINCT v % 7 FROM unnest(
        skiplock.internal_cron_field(expression, texts[o + 5], 'day-of-week', starts[o + 5], 0, 7,
            '{SUN,MON,TUE,WED,THU,FRI,SAT}', 0)) v ORDER BY 1);
    days_any := texts[o + 3] IN ('*', '?');
    weekdays_any := texts[o + 5] IN ('*', '?');
    interval_job := (o = 1 AND texts[1] LIKE '*%') OR texts[o + 1] LIKE '*%' OR texts[o + 2] LIKE '*%';
END;
$$;

-- The latest local time at or before `bound` that the fields match, looking back no
-- further than the day of `earliest`; NULL if there is none.
CREATE OR REPLACE FUNCTION skiplock.internal_cron_previous_local(
    seconds int[], minutes int[], hours int[], days int[], months int[], weekdays int[],
    days_any boolean, weekdays_any boolean, bound timestamp, earliest timestamp)
RETURNS timestamp
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    d date := bound::date;
    clock time := bound::time;
    minute_last int := minutes[cardinality(minutes)];
    second_last int := seconds[cardinality(seconds)];
    day_of_month int;
    day_fits boolean;
    week_fits boolean;
    h int;
    m int;
    s int;
BEGIN
    WHILE d >= earliest::date LOOP
        IF NOT extract(month FROM d)::int = ANY(months) THEN
            -- To the last day of the month before.
            d := date_trunc('month', d)::date - 1;
            clock := time '23:59:59';
            CONTINUE;
        END IF;
        day_of_month := extract(day FROM d)::int;
        day_fits := day_of_month = ANY(days)
            OR (32 = ANY(days) AND extract(day FROM d + 1) = 1);
        week_fits := extract(dow FROM d)::int = ANY(weekdays);
        IF (CASE WHEN days_any OR weekdays_any THEN day_fits AND week_fits
                 ELSE day_fits OR week_fits END) THEN
            FOR h IN SELECT v FROM unnest(hours) v WHERE v <= extract(hour FROM clock) ORDER BY v DESC LOOP
                IF h < extract(hour FROM clock) THEN
                    RETURN d + make_interval(hours => h, mins => minute_last, secs => second_last);
                END IF;
                FOR m IN SELECT v FROM unnest(minutes) v WHERE v <= extract(minute FROM clock) ORDER BY v DESC LOOP
                    IF m < extract(minute FROM clock) THEN
                        RETURN d + make_interval(hours => h, mins => m, secs => second_last);
                    END IF;
                    SELECT max(v) INTO s FROM unnest(seconds) v WHERE v <= floor(extract(second FROM clock));
                    IF s IS NOT NULL THEN
                        RETURN d + make_interval(hours => h, mins => m, secs => s);
                    END IF;
                END LOOP;
            END LOOP;
        END IF;
        d := d - 1;
        clock := time '23:59:59';
    END LOOP;
    RETURN NULL;
END;
$$;

-- The instant a slot named by the local time `wall` runs at, as of `now_at`:
-- - a local time a clock change skips (02:30 when 02:00 jumps to 03:00) runs as Postgres
--   reads it, moved forward by the gap (03:30);
-- - a local time that happens twice (01:30 when 02:00 goes back to 01:00) runs once, at
--   its first instant, unless the schedule is an interval job (see
--   skiplock.internal_cron_parse): then at both, as `* * * * *` runs every minute of both
--   hours, and this returns the later one once it has come.
CREATE OR REPLACE FUNCTION skiplock.internal_cron_slot_instant(wall timestamp, timezone text,
                                                               interval_job boolean,
                                                               now_at timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql STABLE AS $$
DECLARE
    later timestamptz := wall AT TIME ZONE timezone;
    -- The offset in force 3 hours before `later`: before any clock change near it (none
    -- is over 3 hours), so `earlier` is the first instant when the time happens twice.
    before timestamptz := later - interval '3 hours';
    earlier timestamptz := (wall - ((before AT TIME ZONE timezone) - (before AT TIME ZONE 'UTC')))
        AT TIME ZONE 'UTC';
BEGIN
    IF earlier < later AND (earlier AT TIME ZONE timezone) = wall
       AND (NOT interval_job OR later > now_at) THEN
        RETURN earlier;
    END IF;
    RETURN later;
END;
$$;

-- The latest slot at or before `now_at` among the local times at or before `from_wall`
-- (and not before `earliest`), looking at local times going back: with `look_below` NULL the
-- first one that has come; otherwise the latest of all down to `look_below` below the local
-- time of the best found (near a clock change, an earlier local time can be a later
-- instant).
CREATE OR REPLACE FUNCTION skiplock.internal_cron_latest_slot(expression text, timezone text,
                                                              from_wall timestamp,
                                                              earliest timestamp,
                                                              now_at timestamptz,
                                                              look_below interval)
RETURNS timestamptz
LANGUAGE plpgsql STABLE AS $$
DECLARE
    f record;
    wall timestamp := from_wall;
    instant timestamptz;
    best timestamptz;
BEGIN
    SELECT * INTO f FROM skiplock.internal_cron_parse(expression);
    LOOP
        wall := skiplock.internal_cron_previous_local(f.seconds, f.minutes, f.hours, f.days,
            f.months, f.weekdays, f.days_any, f.weekdays_any, wall, earliest);
        EXIT WHEN wall IS NULL OR wall < earliest;
        instant := skiplock.internal_cron_slot_instant(wall, timezone, f.interval_job, now_at);
        IF instant <= now_at AND (best IS NULL OR instant > best) THEN
            best := instant;
        END IF;
        EXIT WHEN best IS NOT NULL
            AND (look_below IS NULL OR wall < (best AT TIME ZONE timezone) - look_below);
        wall := wall - interval '1 second';
    END LOOP;
    RETURN best;
END;
$$;

-- The latest slot of `expression` in `timezone` at or before `now_at` and after
-- `done_until`, or NULL: a local time the expression matches, run at the instant
-- skiplock.internal_cron_slot_instant says.
--
-- Away from clock changes local times and instants keep the same order, so the first slot
-- found looking back from now's local time is the latest. That holds when the UTC offset
-- at that slot is the one in force now, and at every week between (any two clock changes
-- are further apart); such a slot also beats every slot of local times ahead of now's,
-- which after a clock went back may have passed, but before the change. Otherwise (a
-- clock change since the slot, or no slot and a clock that went back within the last 3
-- hours), every local time from 3 hours ahead of now's down to 3 hours below the best
-- slot is looked at.
CREATE OR REPLACE FUNCTION skiplock.internal_cron_due_slot(expression text, timezone text,
                                                           done_until timestamptz,
                                                           now_at timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql STABLE AS $$
DECLARE
    earliest timestamp := (done_until AT TIME ZONE timezone) - interval '3 hours';
    wall timestamp := date_trunc('second', now_at AT TIME ZONE timezone);
    ahead timestamp := date_trunc('second',
        ((now_at - interval '3 hours') AT TIME ZONE timezone) + interval '3 hours');
    offset_now interval := (now_at AT TIME ZONE timezone) - (now_at AT TIME ZONE 'UTC');
    best timestamptz;
BEGIN
    best := skiplock.internal_cron_latest_slot(expression, timezone, wall, earliest, now_at, NULL);
    IF (best IS NULL AND ahead > wall) OR EXISTS (
        SELECT 1 FROM generate_series(best, now_at, interval '7 days') AS g(at)
        WHERE (g.at AT TIME ZONE timezone) - (g.at AT TIME ZONE 'UTC') <> offset_now
    ) THEN
        best := skiplock.internal_cron_latest_slot(expression, timezone, greatest(ahead, wall),
                                                   earliest, now_at, interval '3 hours');
    END IF;
    RETURN CASE WHEN best > done_until THEN best END;
END;
$$;

-- Enqueues the job of each enabled schedule's due slot, and returns how many it enqueued:
-- what the Rust worker's cron pass and skiplock.maintain run. A slot produces exactly one
-- job however many sessions run this at once: a schedule with a due slot is taken with FOR
-- UPDATE SKIP LOCKED (a session that finds it taken leaves it to the one that has it) and
-- only while its last_slot_at is still before the slot, which moves forward in the
-- statement that inserts the job. Schedules with nothing due are read, not locked. With
-- missed = 'skip', a slot more than 60 seconds late is marked done without a job.
--
-- One schedule never stops the others: one that cannot produce its job (a row written by
-- hand that the jobs table refuses, say with max_attempts = 0, or a time zone Postgres no
-- longer knows) records why in its last_error, and the pass goes on. A failure that says
-- nothing about the row (a deadlock, a serialization failure, a server running out of
-- something) is left for the next pass, unrecorded.
CREATE OR REPLACE FUNCTION skiplock.internal_enqueue_cron_slots() RETURNS int
LANGUAGE plpgsql
SET jit = off
AS $$
DECLARE
    s record;
    slot timestamptz;
    enqueued int := 0;
    reason text;
BEGIN
    FOR s IN SELECT c.name, c.expression, c.timezone, c.missed, c.last_slot_at
             FROM skiplock.cron_schedules c WHERE c.enabled ORDER BY c.name LOOP
        BEGIN
            slot := skiplock.internal_cron_due_slot(s.expression, s.timezone, s.last_slot_at, now());
            CONTINUE WHEN slot IS NULL;
            -- Only a due schedule is locked (a lock is a write): taken, unless another
            -- session has it, and still not done up to this slot.
            PERFORM 1 FROM skiplock.cron_schedules c
            WHERE c.name = s.name AND c.enabled AND c.last_slot_at < slot
            FOR UPDATE SKIP LOCKED;
            CONTINUE WHEN NOT FOUND;
            IF s.missed = 'skip' AND now() - slot > interval '60 seconds' THEN
                UPDATE skiplock.cron_schedules SET last_slot_at = slot, updated_at = now()
                WHERE name = s.name;
            ELSE
                -- The job id is drawn first so the schedule records it in the same update.
                WITH advanced AS (
                    UPDATE skiplock.cron_schedules
                    SET last_slot_at = slot, updated_at = now(), last_error = NULL,
                        last_job_id = nextval(pg_get_serial_sequence('skiplock.jobs', 'id'))
                    WHERE name = s.name
                    RETURNING last_job_id, kind, args, queue, priority, max_attempts
                )
                INSERT INTO skiplock.jobs (id, kind, args, queue, priority, max_attempts, scheduled_at)
                OVERRIDING SYSTEM VALUE
                SELECT last_job_id, kind, args, queue, priority, max_attempts, slot FROM advanced;
                enqueued := enqueued + 1;
            END IF;
        EXCEPTION WHEN OTHERS THEN
            IF left(SQLSTATE, 2) IN ('40', '53', '57', '58') OR SQLSTATE = '55P03' THEN
                CONTINUE;
            END IF;
            reason := skiplock.internal_error_message(SQLERRM);
            UPDATE skiplock.cron_schedules SET last_error = reason, updated_at = now()
            WHERE name = s.name AND last_error IS DISTINCT FROM reason;
        END;
    END LOOP;
    RETURN enqueued;
END;
$$;

-- A schedule is checked as it is written, by whoever writes it (the CLI, the Rust API,
-- plain SQL): a malformed expression or an unknown time zone is refused with the error
-- naming the bad part, so no schedule sits in the table that no worker can fire.
CREATE OR REPLACE FUNCTION skiplock.internal_cron_schedules_before_write() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' OR (NEW.expression, NEW.timezone) IS DISTINCT FROM (OLD.expression, OLD.timezone) THEN
        IF NEW.timezone IS NULL OR NOT EXISTS (SELECT 1 FROM pg_timezone_names WHERE name = NEW.timezone) THEN
            RAISE EXCEPTION 'unknown time zone `%`; use an IANA name such as UTC or Europe/Paris',
                NEW.timezone
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        -- An expression no local time matches (day 31 of February, of April and June) is
        -- refused: it would never make a job. 29 years of local times cover every calendar
        -- (days of the month, months, weekdays and leap days come round in 28).
        IF (SELECT skiplock.internal_cron_previous_local(f.seconds, f.minutes, f.hours, f.days,
                   f.months, f.weekdays, f.days_any, f.weekdays_any,
                   localtimestamp + interval '29 years', localtimestamp::timestamp)
            FROM skiplock.internal_cron_parse(NEW.expression) f) IS NULL THEN
            RAISE EXCEPTION 'cron expression `%` never fires: no date matches it (a day of the month that month never has?)',
                NEW.expression
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END IF;
    RETURN NEW;
END;
$$;

CREATE OR REPLACE TRIGGER cron_schedules_before_write
    BEFORE INSERT OR UPDATE ON skiplock.cron_schedules
    FOR EACH ROW EXECUTE FUNCTION skiplock.internal_cron_schedules_before_write();
