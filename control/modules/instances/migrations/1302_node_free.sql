-- The hosted pools' free atoms, kept per node so that a placement reads one index entry instead of every node's
-- inventory: what the node's inventory advertises (cap_*, kept by a trigger on its cpu, memory and disks sections)
-- and what its placed and deleting instances hold (used_*, written by the placement and the delete confirmation
-- in their transactions). GPUs stay the devices rows (reservations book them too).
CREATE TABLE instance_node_free (
    node_id          text PRIMARY KEY REFERENCES nodes (id) ON DELETE CASCADE,
    pool_id          text NOT NULL,
    cap_vcpus        bigint NOT NULL DEFAULT 0,
    cap_memory_mib   bigint NOT NULL DEFAULT 0,
    cap_disk_gib     bigint NOT NULL DEFAULT 0,
    used_vcpus       bigint NOT NULL DEFAULT 0,
    used_memory_mib  bigint NOT NULL DEFAULT 0,
    used_disk_gib    bigint NOT NULL DEFAULT 0,
    free_vcpus       bigint GENERATED ALWAYS AS (cap_vcpus - used_vcpus) STORED,
    free_memory_mib  bigint GENERATED ALWAYS AS (cap_memory_mib - used_memory_mib) STORED,
    free_disk_gib    bigint GENERATED ALWAYS AS (cap_disk_gib - used_disk_gib) STORED
);
-- The placement's walk: the fullest node of the pool that still fits comes first.
CREATE INDEX instance_node_free_fit
    ON instance_node_free (pool_id, free_vcpus, free_memory_mib, free_disk_gib, node_id);

-- A number the node reported, or 0 when it is not a sane one (a node's report never breaks the write of it).
CREATE FUNCTION bc_inventory_count(v jsonb) RETURNS bigint LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN jsonb_typeof(v) IS DISTINCT FROM 'number' THEN 0
                WHEN (v #>> '{}')::numeric BETWEEN 0 AND 1e18 THEN floor((v #>> '{}')::numeric)::bigint
                ELSE 0 END
$$;

-- Recomputes node `n`'s advertised atoms from its inventory sections: `cpu.threads` vCPUs, `memory.total_bytes` in
-- MiB, the sum of its non-removable disks' `size_bytes` in GiB.
CREATE FUNCTION bc_instance_node_caps(n text) RETURNS void LANGUAGE sql AS $$
    INSERT INTO instance_node_free (node_id, pool_id, cap_vcpus, cap_memory_mib, cap_disk_gib)
    SELECT nd.id, nd.pool_id,
        COALESCE((SELECT bc_inventory_count(s.payload -> 'threads') FROM inventory_sections s
                  WHERE s.node_id = nd.id AND s.name = 'cpu'), 0),
        COALESCE((SELECT bc_inventory_count(s.payload -> 'total_bytes') / 1048576 FROM inventory_sections s
                  WHERE s.node_id = nd.id AND s.name = 'memory'), 0),
        COALESCE((SELECT (sum(bc_inventory_count(x -> 'size_bytes')::numeric) / 1073741824)::bigint
                  FROM inventory_sections s,
                       jsonb_array_elements(CASE WHEN jsonb_typeof(s.payload -> 'disks') = 'array'
                                                 THEN s.payload -> 'disks' ELSE '[]' END) x
                  WHERE s.node_id = nd.id AND s.name = 'disks'
                    AND (x -> 'removable') IS DISTINCT FROM 'true'::jsonb), 0)
    FROM nodes nd WHERE nd.id = n
    ON CONFLICT (node_id) DO UPDATE SET pool_id = EXCLUDED.pool_id, cap_vcpus = EXCLUDED.cap_vcpus,
        cap_memory_mib = EXCLUDED.cap_memory_mib, cap_disk_gib = EXCLUDED.cap_disk_gib
$$;

-- Recomputes what node `n`'s placed and deleting instances hold (after a delete is confirmed or a node revoked).
CREATE FUNCTION bc_instance_node_used(n text) RETURNS void LANGUAGE sql AS $$
    UPDATE instance_node_free f SET
        used_vcpus = COALESCE(u.vcpus, 0), used_memory_mib = COALESCE(u.memory_mib, 0),
        used_disk_gib = COALESCE(u.disk_gib, 0)
    FROM (SELECT sum(vcpus)::bigint AS vcpus, sum(memory_mib)::bigint AS memory_mib, sum(disk_gib)::bigint AS disk_gib
          FROM instances WHERE node_id = n AND state IN ('placed', 'deleting')) u
    WHERE f.node_id = n
$$;

CREATE FUNCTION bc_instance_node_caps_trigger() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM bc_instance_node_caps(NEW.node_id);
    RETURN NULL;
END
$$;
CREATE TRIGGER instance_node_caps AFTER INSERT OR UPDATE OF payload ON inventory_sections
    FOR EACH ROW WHEN (NEW.name IN ('cpu', 'memory', 'disks')) EXECUTE FUNCTION bc_instance_node_caps_trigger();

CREATE FUNCTION bc_instance_node_pool_trigger() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE instance_node_free SET pool_id = NEW.pool_id WHERE node_id = NEW.id;
    RETURN NULL;
END
$$;
CREATE TRIGGER instance_node_pool AFTER UPDATE OF pool_id ON nodes
    FOR EACH ROW WHEN (OLD.pool_id IS DISTINCT FROM NEW.pool_id) EXECUTE FUNCTION bc_instance_node_pool_trigger();

-- The nodes that already reported, and what their instances already hold.
SELECT bc_instance_node_caps(id) FROM nodes
    WHERE EXISTS (SELECT 1 FROM inventory_sections s WHERE s.node_id = nodes.id AND s.name IN ('cpu', 'memory', 'disks'));
SELECT bc_instance_node_used(node_id) FROM instance_node_free;
