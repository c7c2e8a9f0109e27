-- A small database in the layout of Spider's concert_singer (data written for these tests).
CREATE TABLE singer (
  singer_id INTEGER PRIMARY KEY,
  name TEXT NOT NULL,
  country TEXT NOT NULL,
  age INTEGER NOT NULL
);
CREATE TABLE concert (
  concert_id INTEGER PRIMARY KEY,
  concert_name TEXT NOT NULL,
  year INTEGER NOT NULL
);
CREATE TABLE singer_in_concert (
  concert_id INTEGER REFERENCES concert(concert_id),
  singer_id INTEGER REFERENCES singer(singer_id)
);
INSERT INTO singer VALUES (1, 'Ana Lima', 'Brazil', 52), (2, 'Jon Berg', 'Norway', 29),
  (3, 'Mei Chen', 'China', 45), (4, 'Paulo Reis', 'Brazil', 38), (5, 'Ida Holm', 'Norway', 61);
INSERT INTO concert VALUES (1, 'Summer Nights', 2014), (2, 'Winter Gala', 2015);
INSERT INTO singer_in_concert VALUES (1, 1), (1, 2), (2, 3), (2, 5);
