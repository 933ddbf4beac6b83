-- Demo schema: `walbridge up` (embedded) and docker compose (init script) both load this file.
CREATE TABLE customers (id bigint PRIMARY KEY, name text NOT NULL, email text, profile jsonb,
                        created_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE orders (id bigint PRIMARY KEY, customer_id bigint REFERENCES customers(id), region text NOT NULL,
                     total numeric(12,2) NOT NULL, status text NOT NULL DEFAULT 'new',
                     placed_at timestamptz NOT NULL DEFAULT now());
ALTER TABLE orders REPLICA IDENTITY FULL;  -- exact move-in/move-out for the filtered shape
CREATE TABLE audit_log (at timestamptz NOT NULL DEFAULT now(), actor text, action text);  -- no primary key
ALTER TABLE audit_log REPLICA IDENTITY FULL;
INSERT INTO customers (id, name, email, profile)
SELECT g, 'customer ' || g, 'c' || g || '@example.com', jsonb_build_object('tier', g % 3) FROM generate_series(1, 1000) g;
INSERT INTO orders (id, customer_id, region, total)
SELECT g, 1 + g % 1000, (ARRAY['eu','us','apac'])[1 + g % 3], round((random() * 500)::numeric, 2)
FROM generate_series(1, 5000) g;
